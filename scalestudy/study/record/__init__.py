"""What a study records and reads back: the registry, the stage records, the phase lines."""
