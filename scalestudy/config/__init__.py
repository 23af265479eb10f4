"""The run config and its sections, the frozen base, YAML loading and the user errors."""
