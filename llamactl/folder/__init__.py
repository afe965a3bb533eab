"""Model folders on disk: artifacts and their manifests, config, checkpoint shards, signing."""
