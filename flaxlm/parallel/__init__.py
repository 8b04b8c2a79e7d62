"""The Partitioner (mesh per platform, logical axis rules, shardings), pytrees and platforms."""
