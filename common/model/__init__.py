"""The model: the frozen ViT, its prompts or adapters, weights, and a process's runtime."""
