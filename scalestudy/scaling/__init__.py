"""scaling."""
