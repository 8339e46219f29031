"""What a worker computes with: its engines (synthetic or a real HF model) and the paced
compute that holds a turn to a deployment's pace."""
