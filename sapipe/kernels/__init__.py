"""Fused kernels: the compiled extension's loader, the ops and their pure-PyTorch references, the
gradient spec, the codec's stages."""
