"""Device backends shipped with DeepInfer, each registered under the `deepinfer.backends` entry-point group."""
