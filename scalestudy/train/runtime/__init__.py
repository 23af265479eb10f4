"""A run's processes: distributed start-up and stop signals."""
