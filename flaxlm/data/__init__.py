"""The input pipeline: dataset configs, logical input shards, vocabularies and packing."""
