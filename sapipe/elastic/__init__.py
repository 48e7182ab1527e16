"""Elastic averaging (EASGD, EA-Pipe's eq. (1)) as a data-parallel training mode: each rank
steps on its own gradients and, every ``period`` steps, its model and a centre variable pull
towards each other, the sum that moves the centre hidden behind the next period's steps
(:mod:`sapipe.elastic.averaging` has the rule; :mod:`sapipe.elastic.exchange` what travels)."""

from sapipe.elastic.averaging import CHECKPOINT_FORMAT, DEFAULT_BETA, ElasticAveraging

__all__ = ["CHECKPOINT_FORMAT", "DEFAULT_BETA", "ElasticAveraging"]
