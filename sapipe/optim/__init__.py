"""The update rules: the fused path (SGD, Adam, AdamW on flat segments), the generic path, staleness
compensation."""
