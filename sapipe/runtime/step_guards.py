"""Refusals of a ``step()`` whose inputs sapipe could only turn into wrong arithmetic, silently:
a GradScaler that does not pass itself, param groups replaced behind sapipe's back."""

from __future__ import annotations

from sapipe.errors import UsageError


def require_scaler_in_step(optimizer) -> None:
    """Refuse a ``GradScaler`` that scaled this step without passing itself to ``step()``.

    torch has announced that ``GradScaler.step`` will stop passing ``grad_scaler=`` and set
    ``optimizer.grad_scale`` / ``optimizer.found_inf`` instead. sapipe needs the scaler itself:
    whether a step is skipped must be agreed over ranks and written back into every rank's
    scaler. Stepping scaled gradients as if unscaled would be silently wrong, so this raises.
    """
    if (
        getattr(optimizer, "found_inf", None) is not None
        or getattr(optimizer, "grad_scale", None) is not None
    ):
        raise UsageError(
            "a GradScaler stepped this optimizer without passing itself as step(grad_scaler=...) "
            "(it set optimizer.grad_scale / found_inf instead, a protocol of newer torch); sapipe "
            "needs "
            "the scaler itself to agree on skipped steps over ranks"
        )


def require_shared_groups(optimizer) -> None:
    """Refuse a step once the wrapped optimizer's ``param_groups`` are no longer the list sapipe
    (and LR schedulers) share with it: its own ``load_state_dict`` after wrapping replaces them,
    and sapipe would go on with the old hyper-parameters, silently."""
    if optimizer.optimizer.param_groups is not optimizer.param_groups:
        raise UsageError(
            "the wrapped optimizer's param_groups were replaced after wrapping (by its own "
            "load_state_dict?); "
            "load a torch.optim state dict through the sapipe optimizer's load_state_dict, or into "
            "the torch "
            "optimizer before wrapping it"
        )


__all__ = ["require_scaler_in_step", "require_shared_groups"]
