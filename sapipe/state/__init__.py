"""State in and out: the checkpoint format and its checks, a wrapped optimizer's plain state
dict."""
