"""The application layer: reads ml_collections configs, builds the library's typed objects, and
turns the library's typed errors into `--config.` flag advice. Only the CLIs import it."""
