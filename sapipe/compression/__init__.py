"""Compression on the wire: formats, their error feedback, and each bucket's codec."""
