"""Generation and scoring under a Partitioner, and the pure decoding loops they drive."""
