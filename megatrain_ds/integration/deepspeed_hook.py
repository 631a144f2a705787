"""What the routing of ``deepspeed.initialize`` decides, for configs with ``"engine": "megatrain"``.

Pure functions over configs and call arguments; the patches that apply them to DeepSpeed
and Accelerate are all in ``compat.py`` (the one module that changes third-party objects):

- :func:`initialize_config`: the config a ``deepspeed.initialize`` call names; the wrapper of
  ``deepspeed.initialize`` sends megatrain configs to
  :func:`megatrain_ds.integration.initialize.initialize` and every other call, unchanged,
  to DeepSpeed.
- :func:`complete_minimal_config`: what Accelerate's ``HfDeepSpeedConfig`` (the base of the
  HF Trainer's and of transformers') adds to a megatrain config, ``{"engine": "megatrain"}``
  plus what the user cares about: ``"zero_optimization": {"stage": 0}`` and ``"auto"``
  batch, accumulation and clipping keys ([Note: the minimal config]), and a ZeRO-3
  config read as stage 0 ([Note: ZeRO-3 configs]).
- :func:`zero_init_config`: the config a ``deepspeed.zero.Init`` call names; given a
  megatrain config it does nothing ([Note: ZeRO-3 configs]).
- :func:`prepare_evaluation_config`: what the HF Trainer's ``deepspeed_init(inference=True)``
  (``evaluate()`` or ``predict()`` before ``train()``) does to a megatrain config, where
  transformers' own refuses any stage but 3 ([Note: evaluation before training]).

Set ``MEGATRAIN_DISABLE_HOOK=1`` to turn all of them off (checked per call).

Two ways in, one mechanism (``_megatrain_ds_hook.install``, the start-up module installed
beside the package; it imports ``compat.py``, never the other way round):

- zero-code: ``_megatrain_ds_hook.pth`` registers an import watcher at interpreter
  start-up, so a script that never imports ``megatrain_ds`` (an Accelerate or HF Trainer
  script) is routed as soon as it, or a library, imports ``deepspeed``;
- explicit: ``import megatrain_ds`` calls the same ``install``, which patches ``deepspeed``
  now if it is imported, or registers the watcher.

Accelerate looks ``deepspeed.initialize`` up when it prepares the model and the HF Trainer
goes through Accelerate, so both see the wrapper.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from megatrain_ds.config import AUTO, load_config_dict

DISABLE_ENV = "MEGATRAIN_DISABLE_HOOK"
"""Also read by ``_megatrain_ds_hook`` at start-up, which must not import this package."""


def initialize_config(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The config a ``deepspeed.initialize(...)`` call names (``config=``, ``config_params=``
    or ``args.deepspeed_config``), as a dict, or ``None``."""
    config = kwargs.get("config", kwargs.get("config_params"))
    if config is None:
        cli_args = kwargs.get("args", args[0] if args else None)
        config = getattr(cli_args, "deepspeed_config", None)
    if config is None:
        return None
    try:
        return load_config_dict(config)
    except (OSError, ValueError, TypeError):
        return None  # not ours to judge: DeepSpeed reports its own config errors


FILLED_BY_THE_CLIENT: dict[str, Any] = {
    "zero_optimization": {"stage": 0},
    "train_batch_size": AUTO,
    "train_micro_batch_size_per_gpu": AUTO,
    "gradient_accumulation_steps": AUTO,
    "gradient_clipping": AUTO,
}
"""What a megatrain config read by Accelerate or the HF Trainer gets for each of these keys
it leaves out ([Note: the minimal config])."""


def complete_minimal_config(config: dict[str, Any]) -> None:
    """Give a megatrain config, in place (a reader's copy), the keys of
    :data:`FILLED_BY_THE_CLIENT` it leaves out, and read its ZeRO stage 3 as 0
    (:func:`read_zero3_as_stage0`). ``compat.complete_megatrain_configs`` calls it from
    ``accelerate.utils.deepspeed.HfDeepSpeedConfig.__init__``.

    [Note: the minimal config]
    A user writes ``{"engine": "megatrain", "optimizer": ...}`` and runs it under the HF
    Trainer or Accelerate. Accelerate's ``DeepSpeedPlugin`` (the Trainer goes through it)
    refuses a config without ``zero_optimization`` ("Please specify the ZeRO optimization
    config in the DeepSpeed config.") and indexes that block later; stage 0 is what this
    engine is (its ``zero_optimization_stage()``), so nothing downstream assumes
    partitioning. Both fill only the batch, accumulation and clipping keys that say
    ``"auto"`` and leave missing ones missing (so ``deepspeed.initialize`` would find no
    batch size, and Accelerate would force one accumulation step); a missing key is made
    ``"auto"``, so they come from the DataLoader or ``TrainingArguments`` and
    ``Accelerator(gradient_accumulation_steps=...)`` as with the shipped
    ``configs/ds_megatrain_hf.json`` (Accelerate's ``"auto"`` clipping is 1.0, the Trainer's
    is ``max_grad_norm``). Precision is left to them: Accelerate adds the ``bf16`` block for
    ``mixed_precision="bf16"`` itself. The config edited is the reader's own copy
    (Accelerate deep-copies a dict and parses a file), never the user's object, and
    ``deepspeed.initialize`` called directly is not involved: like DeepSpeed it needs a
    batch size.
    """
    for key, value in FILLED_BY_THE_CLIENT.items():
        config.setdefault(key, copy.deepcopy(value))
    read_zero3_as_stage0(config)


def read_zero3_as_stage0(config: dict[str, Any]) -> None:
    """Make a megatrain config's ``zero_optimization.stage`` 3 read as 0, in place (a reader's copy).

    [Note: ZeRO-3 configs]
    Users bring their ZeRO-3 offload JSON and add ``"engine": "megatrain"``. At stage 3 the
    frameworks build the model partitioned: transformers asks ``HfDeepSpeedConfig.is_zero3()``
    (``is_deepspeed_zero3_enabled``) and then builds ``from_pretrained``/``from_config``
    models under ``deepspeed.zero.Init``, which leaves each parameter an empty placeholder
    (Accelerate's ``zero3_init_flag`` only sets that config up), and Accelerate, the Trainer
    and TRL key their saving, gathering and PEFT paths on the plugin's ``zero_stage``. This
    engine keeps every parameter whole in host memory: it is stage 0 (its
    ``zero_optimization_stage()``). So the reader's copy of a megatrain config says stage 0,
    and everything downstream takes the ordinary, unpartitioned path that stage-0 configs
    already take: ``from_pretrained`` builds on the meta device and takes each parameter
    from the memory-mapped shards (no partitioned copy, no merged state dict), after which
    the engine moves the parameters into its host state one at a time
    (``state/host_store.py``), so loading needs no more than the engine's steady state plus
    about one parameter (``bench/stage3_load.py``); saving gets the full state dict. Accelerate then says that
    ``zero3_init_flag`` "is only applicable for ZeRO Stage 3" and sets it to false, which
    is what happens. The engine itself accepts any stage (``config/deepspeed_keys.py``), and the user's
    file or dict is untouched (Accelerate deep-copies a dict and parses a file).
    ``deepspeed.zero.Init`` given a megatrain config (a script of the user's that builds
    its model under it, as DeepSpeed's docs show) does nothing, for the same reason
    (``compat.build_models_whole``). A model partitioned anyway (``zero.Init`` without a
    config, or with another one) is refused by ``initialize`` with the way out.
    """
    zero = config.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage") == 3:
        zero["stage"] = 0


def zero_init_config(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The config a ``deepspeed.zero.Init(...)`` call names, as a dict, or ``None``."""
    try:
        bound = signature.bind_partial(None, *args, **kwargs).arguments  # None: ``self``
    except TypeError:
        return None  # DeepSpeed reports its own argument errors
    if not bound.get("enabled", True):
        return None
    config = bound.get("config_dict_or_path", bound.get("config"))
    try:
        return load_config_dict(config) if config is not None else None
    except (OSError, ValueError, TypeError):
        return None


def prepare_evaluation_config(hf_config: Any, args: Any, model: Any, num_training_steps: int) -> None:
    """Ready a megatrain config for an engine built to evaluate before any training, in place
    (the reader's copy): what transformers' ``deepspeed_init(inference=True)`` does, without
    its stage check. ``compat.evaluate_before_training`` calls it.

    [Note: evaluation before training]
    The HF Trainer's ``evaluate()`` or ``predict()`` before any ``train()`` (or a
    ``--do_eval``-only run) calls ``deepspeed_init(trainer, 0, inference=True)``, then prepares
    the model alone: ``deepspeed.initialize`` with no optimizer. transformers refuses that
    unless the config reads as ZeRO stage 3 ("ZeRO inference only makes sense with ZeRO Stage
    3"), since only DeepSpeed's stage 3 does more than plain PyTorch there. A megatrain
    config reads as stage 0 ([Note: ZeRO-3 configs], [Note: the minimal config]), so a ZeRO-3
    JSON that evaluates on DeepSpeed stopped there once the engine key was added; yet this
    engine is what stage 3 is for, streaming weights that need not fit the device. So for a
    megatrain config the inference call does what transformers' does after its check, at any
    stage: ``trainer_config_finalize`` fills the ``"auto"`` values from ``TrainingArguments``
    and the model (with 0 training steps, as transformers does: a ``"scheduler"`` block's
    ``total_num_steps`` becomes 0), and the ``"optimizer"`` block is dropped, so that
    ``deepspeed.initialize`` builds the engine without an optimizer (optimizer/facade.py:
    [Note: evaluation-only engines]): every weight held as a frozen one, with no moment or
    gradient beside it; forward only. transformers also sets DeepSpeed's logger to
    the Trainer's log level (not done here: it sets only what DeepSpeed's logger prints) and drops
    ``"lr_scheduler"``, a key no DeepSpeed config has; a ``"scheduler"`` block stays and, without an optimizer, is
    not built, by either engine. A ``train()`` after such an ``evaluate()`` stops as it stops
    on DeepSpeed's ZeRO-3 (both checked with transformers 5.23.0 and Accelerate 1.15.0): with
    a ``"scheduler"`` block at transformers' check that its ``total_num_steps`` (0) matches
    the run's; without one at the first ``backward()``, in Accelerate ("'NoneType' object
    has no attribute 'backward'": the Trainer then prepares the optimizer alone, and
    Accelerate wraps no engine for training). Called directly, the engine's ``backward()``
    and ``step()`` refuse, saying why.
    """
    hf_config.trainer_config_finalize(args, model, num_training_steps)
    hf_config.config.pop("optimizer", None)
