"""Architecture x objective scaling studies of language models in JAX/Flax NNX."""
