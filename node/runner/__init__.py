"""The runner: MLX executes in its own OS process so a crash never takes the node down."""
