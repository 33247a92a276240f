"""Input: the Grain pipeline, augmentation, and the data sources (ArrayRecord,
image files, Hugging Face, TFDS)."""
