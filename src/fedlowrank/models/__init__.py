"""Models: loading ``task.model`` (bundled names, local folders, hub ids), ResNet-20, sentence embeddings."""
