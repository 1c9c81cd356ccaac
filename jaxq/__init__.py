"""jaxq: a functional compiler toolkit whose IR is JAX's jaxpr."""
