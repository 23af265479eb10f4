"""A study running: the main job, executors, cluster, registry, lock, stages."""
