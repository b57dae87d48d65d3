"""`kiln evaluate` and `kiln predict`: which weights they score (chosen before the model is built), and the
scoring itself, whose results are written into the weights' folder."""

from __future__ import annotations

from typing import Any


def pick_weights(cfg: Any, weights: str | None, random_weights: bool) -> Any:
    """The weights evaluate/predict score: --weights, resume_from_checkpoint=PATH, or the run's own;
    None only with --random-weights. Chosen before the model and data are built."""
    from kiln.engine.checkpoint.remote_run import fetch_checkpoint, options, store_of
    from kiln.engine.checkpoint.signing import signing_key
    from kiln.engine.checkpoint.weights import find_run_weights, given_weights
    from kiln.utils.errors import KilnError
    from kiln.utils.storage_urls import is_remote

    resume = cfg.resume_from_checkpoint
    if weights is None and resume and str(resume).lower() not in ("true", "false", "none", "if_exists"):
        weights = str(resume)  # `resume_from_checkpoint=PATH` names the weights too
    if random_weights:
        if weights is not None:
            raise KilnError("--random-weights and --weights contradict each other; pass one of them.")
        return None
    key = signing_key(cfg.save.signing_key_env)  # signed checkpoints only, when set
    if weights is not None:
        if is_remote(weights):  # a checkpoint on a store: downloaded, digests checked
            weights = fetch_checkpoint(weights, options(cfg), key)
        return given_weights(weights, key)
    found = find_run_weights(cfg.output_dir, key)
    store = store_of(cfg)
    if found is None and store is not None and store.download_newest(cfg.output_dir, key) is not None:
        found = find_run_weights(cfg.output_dir, key)  # the run's store: its newest intact checkpoint
    if found is None:
        import os

        where = "" if os.path.isabs(cfg.output_dir) else f" (in {os.getcwd()})"
        raise KilnError(
            f"output_dir {cfg.output_dir!r}{where} holds no checkpoint or exported model to score; pass --weights PATH "
            "(a checkpoint-<step> folder or a save_model folder), or --random-weights for the untrained model."
        )
    return found


def score(command: str, trainer: Any, data: dict[str, Any], weights: Any) -> None:
    """evaluate / predict with `weights`, writing the results into the weights' folder."""
    import json
    import os

    if weights is not None:
        trainer._load_from_checkpoint(weights.path)
        trainer.state.global_step, trainer.state.epoch = weights.step or 0, weights.epoch  # reported with the metrics
        where, about = weights.path, {"weights": weights.path, "step": weights.step}
    else:
        where, about = os.path.join(trainer.config.output_dir, "random-weights"), {"weights": None, "step": 0}
    zero = trainer.is_world_process_zero()
    if zero:
        verb = "evaluating" if command == "evaluate" else "predicting with"
        print(
            f"kiln: {verb} the {weights.describe()}"
            if weights is not None
            else f"kiln: {verb} the untrained model (--random-weights); results go to {where}",
            flush=True,
        )
    if command == "evaluate":
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        name = "evaluate_results.json"
    else:
        dataset = data.get("test_dataset", data.get("eval_dataset"))
        out = trainer.predict(dataset)
        metrics = out.metrics
        trainer.log_metrics("test", metrics)
        name = "predict_results.json"
        if zero:
            import numpy as np

            os.makedirs(where, exist_ok=True)
            np.save(os.path.join(where, "predictions.npy"), out.predictions)
    if zero:
        from kiln.engine.evaluation.outputs import to_python

        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, name), "w", encoding="utf-8") as fh:
            json.dump({**about, **{k: to_python(v) for k, v in metrics.items()}}, fh, indent=2)
        print(f"kiln: wrote {os.path.join(where, name)}", flush=True)
