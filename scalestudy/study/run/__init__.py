"""A study running: the main job (its report included), compile plans, executors, cluster,
lock, stages."""
