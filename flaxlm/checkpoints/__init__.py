"""What is on disk: orbax train-state checkpoints, the HF format, an HF directory's files, and
the MODEL_DIR contract."""
