"""A Hugging Face causal LM's labelled loss, from its final hidden states, in chunks.

A causal LM called with ``labels=`` computes ``logits = lm_head(h)`` for every token and
then ``ForCausalLMLoss(logits, labels)``: at long context the logits, their fp32 copy,
their softmax and their gradient (``tokens x vocab`` each) are the largest tensors of the
step. :class:`ChunkedCausalLMLoss` runs such a call without them:

1. ``labels`` (and the loss's own keyword arguments ``num_items_in_batch``,
   ``ignore_index``, ``shift_labels``) are taken out of the call, so the model computes no
   loss;
2. for that one call, the output embedding's ``forward`` captures its input ``h`` and
   returns a ``B x T x 0`` placeholder instead of logits;
3. the model's output must carry that very placeholder as its logits: a model that
   transforms its logits after the projection (softcapping, scaling) would return another
   tensor, and is refused (see :func:`unsupported_reason`);
4. the loss is ``chunked_linear_cross_entropy(h, W, b, shifted labels)``
   (model/chunked_loss.py), exactly Hugging Face's: labels shifted left by one and padded
   with ``ignore_index``, the mean over non-ignored targets, or the sum divided by
   ``num_items_in_batch`` when the HF Trainer passes it.

The output has the loss and no logits (``logits`` is ``None``); everything else the model
returned is kept. Calls without labels, without gradients or in eval mode (where the HF
Trainer wants logits for its metrics), and calls of a forward another library replaced on
the instance (TRL's fused LM head), run the model unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from megatrain_ds.model.chunked_loss import WeightGradPush, chunked_linear_cross_entropy

logger = logging.getLogger(__name__)

_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
# Config keys of Hugging Face models that transform the logits after the output
# projection (Gemma 2/3 softcapping, Cohere's scale, Granite's divisor, ...).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def linear_head(model: nn.Module) -> nn.Linear | None:
    """``model.get_output_embeddings()`` (Hugging Face's ``lm_head``) when it is a plain
    ``nn.Linear``, the projection the chunked loss computes; ``None`` otherwise."""
    model = causal_lm_inside(model)
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if get_output_embeddings is not None else None
    return head if type(head) is nn.Linear else None


def causal_lm_inside(model: nn.Module) -> nn.Module:
    """The model whose loss a labelled call of ``model`` computes: ``model``, or the Hugging
    Face model inside a PEFT wrapper (``get_peft_model``) whose adapter leaves the inputs
    alone (LoRA and the other non-prompt-learning adapters): its ``forward`` hands the call,
    labels included, to that model and returns its output unchanged. A prompt-learning
    adapter (prefix or prompt tuning) prepends virtual tokens and pads the labels to match,
    so it is kept as it is (and refused: no ``loss_function``). Duck-typed: PEFT's names,
    no import of it."""
    get_base_model = getattr(model, "get_base_model", None)
    adapter = getattr(model, "active_peft_config", None)
    if callable(get_base_model) and adapter is not None and getattr(adapter, "is_prompt_learning", True) is False:
        inner = get_base_model()
        if isinstance(inner, nn.Module):
            return inner
    return model


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model``'s labelled loss cannot be chunked, or ``None`` when it can (a PEFT
    wrapper's: its model's, :func:`causal_lm_inside`)."""
    model = causal_lm_inside(model)
    if getattr(type(model), "loss_function", None) is None:
        return "the model has no Hugging Face loss_function (not a causal LM)"
    # Hugging Face's default (loss_type None or "ForCausalLM") unless the user set another;
    # read without the property, which warns when loss_type is None.
    loss_function = vars(model).get("_loss_function")
    if loss_function is None and getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        loss_function = model.loss_function
    if loss_function is not None and getattr(loss_function, "__name__", None) != "ForCausalLMLoss":
        return "its loss_function is not Hugging Face's ForCausalLMLoss"
    if linear_head(model) is None:
        return "its output embedding is not an nn.Linear"
    config = getattr(model, "config", None)
    for key in _LOGIT_TRANSFORMS:
        if getattr(config, key, None) not in (None, 1, 1.0):
            return f"it transforms its logits after the output projection (config.{key}={getattr(config, key)!r})"
    return None


class ChunkedCausalLMLoss:
    """Runs labelled training calls of a Hugging Face causal LM with a chunked loss.

    Args:
        model: the model (``unsupported_reason(model)`` must be ``None``).
        chunk_tokens: tokens per chunk of the loss.
        push_weight_grad: returns where the output projection's weight gradient goes
            instead of autograd (an untied ``lm_head`` whose gradient leaves in row chunks),
            or ``None``; asked at every call.
    """

    def __init__(
        self, model: nn.Module, chunk_tokens: int, push_weight_grad: Callable[[], WeightGradPush | None] = lambda: None
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                f"megatrain.loss_chunk_tokens: the chunked loss cannot run on this model: {reason}; "
                'set "loss_chunk_tokens": 0'
            )
        self.model = model
        head = linear_head(model)
        assert head is not None  # unsupported_reason checked it
        self.head = head
        self.chunk_tokens = chunk_tokens
        self._push_weight_grad = push_weight_grad
        self._logged_patched_forward = False

    def applies(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether this call is a labelled training call (the only kind chunked) of the
        model's own forward. A forward another library put on the instance (TRL's fused LM
        head, which computes its loss in tiles itself) gets its labels and runs unchanged."""
        if kwargs.get("labels") is None or not torch.is_grad_enabled() or not self.model.training:
            return False
        patched = next((m for m in (self.model, causal_lm_inside(self.model)) if "forward" in vars(m)), None)
        if patched is not None:
            if not self._logged_patched_forward:
                self._logged_patched_forward = True
                logger.info(
                    "megatrain: the model's forward was replaced by another library (%s); its labelled "
                    "calls run it unchanged, without the chunked loss",
                    getattr(vars(patched)["forward"], "__qualname__", "unknown"),
                )
            return False
        return True

    def __call__(self, run: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """``run(*args, **kwargs)`` (the model's call) with the loss computed here."""
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels")
        loss_kwargs = {key: kwargs.pop(key) for key in _LOSS_KWARGS if key in kwargs}
        captured: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, placeholder)

        def capture(input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's signature
            placeholder = input.new_empty(*input.shape[:-1], 0)
            captured.append((input, placeholder))
            return placeholder

        own_forward = self.head.__dict__.get("forward")  # the row-chunked redirect, if any
        self.head.forward = capture
        try:
            output = run(*args, **kwargs)
        finally:
            if own_forward is None:
                self.head.__dict__.pop("forward", None)
            else:
                self.head.forward = own_forward
        if len(captured) != 1:
            raise ValueError(
                f"megatrain.loss_chunk_tokens: the model called its output embedding {len(captured)} "
                'times in one forward, not once; set "loss_chunk_tokens": 0'
            )
        hidden, placeholder = captured[0]
        output, found = _without_logits(output, placeholder)
        if not found:
            raise ValueError(
                "megatrain.loss_chunk_tokens: the model changes its logits after the output "
                'projection, which the chunked loss cannot reproduce; set "loss_chunk_tokens": 0'
            )
        loss = self.loss(hidden, labels, **loss_kwargs)
        return _with_loss(output, loss)

    def loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hugging Face's ``ForCausalLMLoss`` of ``lm_head(hidden)``, in chunks."""
        if shift_labels is None:  # tokens < n predict n; the last predicts nothing
            labels = labels.to(hidden.device)
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.reshape(-1).to(hidden.device)
        if num_items_in_batch is None:
            denominator = (targets != ignore_index).sum().to(torch.float32)
        elif isinstance(num_items_in_batch, torch.Tensor):
            denominator = num_items_in_batch.to(hidden.device, torch.float32)
        else:
            denominator = torch.tensor(float(num_items_in_batch), device=hidden.device)
        return chunked_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            self.head.weight,
            self.head.bias,
            targets,
            denominator,
            self.chunk_tokens,
            ignore_index,
            self._push_weight_grad(),
        )


def _without_logits(output: Any, placeholder: torch.Tensor) -> tuple[Any, bool]:
    """``output`` without the placeholder logits, and whether the placeholder itself was
    there (any transformation of it would be another tensor)."""
    if isinstance(output, Mapping) and "logits" in output:  # a ModelOutput
        if output["logits"] is not placeholder:
            return output, False
        fields = {key: value for key, value in output.items() if key != "logits"}
        return type(output)(**fields), True
    if isinstance(output, tuple):
        kept = tuple(value for value in output if value is not placeholder)
        return kept, len(kept) < len(output)
    return output, False


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    """The output as the model returns it when it computed ``loss`` itself."""
    if isinstance(output, tuple):
        return (loss, *output)
    fields = dict(output.items())
    return type(output)(loss=loss, **fields)
