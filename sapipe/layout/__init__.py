"""Layers in forward order, flat gradient buckets and the packing rule that makes them."""
