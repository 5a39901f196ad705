"""TransformerLens' conveniences on any JAX model: residual-stream views, names, sweeps."""
