"""The rollout engine of a check, in a child process fed by a real weight broadcaster (private).

    check process (trainer side)                          engine process (python -m asyncrl.check._engine)
    broadcaster.publish(policy_state(model), v) ══shm/zmq══► receiver I/O thread: stage + verify buckets
    EngineProcess.apply(v)  ─── PAIR (codec frames) ───────► receiver.wait(v) → engine.apply_weights → commit
    EngineProcess.checksums(mode, names) ──────────────────► engine.weight_checksums(mode, names)
    EngineProcess.generate(prompts, n) ────────────────────► engine.generate(requests)   (the worker's call)
    EngineProcess.topk(prompts, n, k) ─────────────────────► the engine's processed distribution, top k per token
    EngineProcess.specs() ─────────────────────────────────► the engine's own parameter names, shapes, dtypes, ties

This is not the rollout worker loop (``workers.worker``): a worker reports post-sync verification only as a
count and at most 200 characters of names in its heartbeat, and generates only against leases of a pool. It
is the same engine, built as a worker builds it (:func:`workers.engines.build_engine` from an
``EngineConfig``, or the ``--engine module:Class`` subclass with that config), fed through the same receiver
(:func:`asyncrl.weights.setup_weight_receiver`), applying and committing updates as the worker's safe point
does, with the worker's :class:`~asyncrl.weights.verify.WeightVerifier` run on every update; so what it
answers is what a worker's engine holds and computes. The process has no torchrun variables (vLLM sets up
``torch.distributed`` itself), dies with its parent (:func:`asyncrl.lifeline.die_with_parent`) and is
ended by pid on close.

Who blocks on what: the check process blocks in :meth:`EngineProcess.request` (polling the socket, and the
child's liveness, until a deadline); the child blocks in ``recv`` between requests and in ``receiver.wait``
(bounded by the request's timeout) while applying.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.check._ranks import torchrun_env_names

__all__ = ["EngineProcess", "engine_config"]

_KIND = "check_engine"
_POLL_MS = 200
_START_S = 300.0


def engine_config(ctx: Any, *, max_model_len: int = 256) -> dict[str, Any]:
    """The engine config fields for a check, by ``ctx.engine``'s type (a dict: it travels to the child as JSON)."""
    own = {"max_model_len": max_model_len, "kv_cache_bytes": 64 << 20} if ctx.engine == "vllm" else {}
    if ctx.qlora:  # an hf field: a vLLM engine is refused the 4-bit base, with the reason
        own["quantization"] = "nf4"
    return {"type": ctx.engine, "model": ctx.model, "dtype": ctx.dtype, "seed": ctx.seed,
            "temperature": ctx.temperature, "top_k": ctx.top_k, "top_p": ctx.top_p,
            "max_new_tokens": ctx.max_new_tokens, "min_new_tokens": 0, "lora_rank": ctx.lora_rank, **own}


class EngineProcess:
    """The parent's handle on the engine child.

    Args:
        ctx: the check's context (engine, dtype, sampling settings, LoRA rank, ``engine_class``).
        weights_type: ``shm`` or ``zmq``, the broadcaster's backend.
        address: the broadcaster's address.
        log_dir: where the child's stdout/stderr go (read back into errors).
    """

    def __init__(self, ctx: Any, *, weights_type: str, address: str, log_dir: str | Path):
        import zmq

        from asyncrl.codec import dumps_json

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:0")
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._log = Path(log_dir) / f"engine-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in torchrun_env_names and not k.startswith("TORCHELASTIC_")}
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
        env.setdefault("HF_HUB_OFFLINE", "1")
        argv = [sys.executable, "-m", "asyncrl.check._engine", "--control", endpoint, "--parent-pid", str(os.getpid()),
                "--config-json", dumps_json(engine_config(ctx)).decode(), "--weights", weights_type,
                "--address", address]
        if ctx.engine_class:
            argv += ["--engine-class", ctx.engine_class]
        for module in ctx.imports:
            argv += ["--import", module]
        with open(self._log, "w") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=repo)
        self.info = self.request("ready", {}, timeout_s=_START_S)
        """What the child reported at start-up: ``{"engine": class name, "pid": ...}``."""

    def log_tail(self, chars: int = 3000) -> str:
        return self._log.read_text(errors="replace")[-chars:] if self._log.exists() else ""

    def request(self, op: str, body: dict[str, Any], *, timeout_s: float = 120.0) -> dict[str, Any]:
        """Sends ``op`` and waits for its reply.

        Raises:
            RuntimeError: the child died (with its log's tail), timed out, or answered with an error.
        """
        from asyncrl.codec import decode, encode

        if op != "ready":
            self._sock.send_multipart(encode(_KIND, {"op": op, **body}), copy=False)
        deadline = time.monotonic() + timeout_s
        while not self._sock.poll(_POLL_MS):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine process exited ({self.proc.returncode}) during {op!r}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine process did not answer {op!r} within {timeout_s:.0f} s:\n"
                                   f"{self.log_tail()}")
        kind, reply = decode(self._sock.recv_multipart(copy=False))
        if kind != _KIND:
            raise RuntimeError(f"the engine process sent a {kind!r} message, expected {_KIND!r}")
        if reply.get("error"):
            raise RuntimeError(f"the engine process failed {op!r}: {reply['error']}")
        return reply

    def apply(self, version: int, timeout_s: float = 120.0) -> dict[str, Any]:
        """The engine waits for ``version`` at its receiver, applies it and commits; returns the verify result."""
        return self.request("apply", {"version": version, "timeout": timeout_s}, timeout_s=timeout_s + 30)

    def checksums(self, mode: str, names: list[str]) -> dict[str, Any]:
        return self.request("checksums", {"mode": mode, "names": names})["checksums"]

    def specs(self) -> dict[str, Any]:
        return self.request("specs", {})

    def generate(self, prompts: list[Any], n: int) -> list[Any]:
        """The engine's completions of each prompt as :class:`~asyncrl.rollout.Group` s."""
        from asyncrl.rollout import Group

        return [Group.from_wire(g) for g in self.request("generate", {"prompts": prompts, "n": n})["groups"]]

    def topk(self, prompts: list[Any], n: int, k: int) -> list[dict[str, Any]]:
        """Sampled rows with the engine's processed top-``k`` per response token (``ids``/``logprobs`` ``[T, k]``)."""
        return self.request("topk", {"prompts": prompts, "n": n, "k": k})["rows"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("close", {}, timeout_s=30)
            except RuntimeError:
                pass  # it is killed below
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._sock.close(linger=0)
        self._ctx.term()


# -- the child ----------------------------------------------------------------------------------------------


def _build(config: dict[str, Any], engine_class: str | None) -> Any:
    import importlib

    from asyncrl.config import EngineConfig, from_dict
    from workers.engines import build_engine

    cfg = from_dict(EngineConfig, config)
    if not engine_class:
        return build_engine(cfg)
    module, _, name = engine_class.partition(":")
    return getattr(importlib.import_module(module), name)(cfg)


def _groups(engine: Any, prompts: list[Any], n: int) -> list[dict[str, Any]]:
    from asyncrl.debug.align import groups_from_completions
    from workers.engines.base import GenerationRequest

    requests = [GenerationRequest(epoch=0, prompt_index=i, prompt=p, n=n) for i, p in enumerate(prompts)]
    return [g.to_wire() for g in groups_from_completions(engine.generate(requests), worker_id="check-engine")]


def _topk_hf(engine: Any, prompts: list[Any], n: int, k: int, seed: int) -> list[dict[str, Any]]:
    """HF: ``generate`` called as :class:`~workers.engines.hf.HFEngine` calls it, its processed scores' top k."""
    from workers.engines.base import prompt_token_ids

    rows = [prompt_token_ids(p, engine.tokenizer) for p in prompts for _ in range(n)]
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), engine.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :], mask[i, width - r.numel() :] = r, 1
    c = engine.config
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = engine.model.generate(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device),
                                    do_sample=True, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                                    max_new_tokens=c.max_new_tokens, pad_token_id=engine.pad_id,
                                    return_dict_in_generate=True, output_scores=True, eos_token_id=engine.stop_ids)
    new = out.sequences[:, width:].cpu()
    logp = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1).cpu()  # [N, T, V]
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    result = []
    for i, r in enumerate(rows):
        stops = torch.isin(new[i], torch.tensor(engine.stop_ids)).nonzero()
        length = int(stops[0, 0]) + 1 if stops.numel() else new.shape[1]
        result.append({"prompt_ids": r.to(torch.int32), "response_ids": new[i, :length].to(torch.int32),
                       "ids": top.indices[i, :length].to(torch.int64), "logprobs": top.values[i, :length]})
    return result


def _topk_vllm(engine: Any, prompts: list[Any], n: int, k: int, seed: int) -> list[dict[str, Any]]:
    """vLLM: the engine's own ``SamplingParams`` with ``logprobs=k`` (processed_logprobs: the sampled distribution)."""
    params = engine._sampling(n, seed)
    params.logprobs = k
    lora = engine._lora_request()  # the LoRARequest the engine's own generate sends (None without an adapter)
    ids_list = [engine._prompt_ids(p) for p in prompts]
    outputs = engine.llm.generate([{"prompt_token_ids": ids} for ids in ids_list], params, lora_request=lora,
                                  use_tqdm=False)
    result = []
    for ids, output in zip(ids_list, outputs):
        for c in output.outputs:
            top_ids = torch.full((len(c.token_ids), k + 1), -1, dtype=torch.int64)
            top_lp = torch.full((len(c.token_ids), k + 1), float("nan"))
            for t, entry in enumerate(c.logprobs):
                ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: k + 1]  # top k and the sampled one
                for j, (tok, lp) in enumerate(ranked):
                    top_ids[t, j], top_lp[t, j] = tok, lp.logprob
            result.append({"prompt_ids": torch.tensor(ids, dtype=torch.int32),
                           "response_ids": torch.tensor(list(c.token_ids), dtype=torch.int32),
                           "ids": top_ids, "logprobs": top_lp})
    return result


def _specs(engine: Any) -> dict[str, Any]:
    """The engine's own parameters: ``{"params": {name: [shape, dtype]}, "tied": [[names sharing storage]]}``."""
    if hasattr(engine, "llm"):
        return engine.llm.collective_rpc("asyncrl_param_specs")[0]
    by_storage: dict[int, list[str]] = {}
    for name, p in engine.model.named_parameters(remove_duplicate=False):
        by_storage.setdefault(p.data_ptr(), []).append(name)
    params = {n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in engine.model.state_dict().items()}
    return {"params": params, "tied": [names for names in by_storage.values() if len(names) > 1], "fused": False}


def _serve(args: argparse.Namespace) -> None:
    import zmq

    from asyncrl.codec import decode, encode, loads_json
    from asyncrl.weights import setup_weight_receiver
    from asyncrl.weights.verify import WeightVerifier

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.control)
    config = loads_json(args.config_json)
    engine = _build(config, args.engine_class)
    receiver = setup_weight_receiver(args.weights, args.address, receiver_id="check-engine")
    receiver.start()
    verifier = WeightVerifier("full")
    sock.send_multipart(encode(_KIND, {"engine": type(engine).__name__, "pid": os.getpid()}))
    calls = 0
    try:
        while True:
            _, msg = decode(sock.recv_multipart(copy=False))
            op = msg["op"]
            try:
                if op == "close":
                    sock.send_multipart(encode(_KIND, {}))
                    return
                if op == "apply":  # the worker's safe point: apply the staged update, verify, commit
                    update = receiver.wait(msg["version"], msg["timeout"])
                    if update is None:
                        raise TimeoutError(f"version {msg['version']} was not staged within {msg['timeout']} s "
                                           f"(receiver: {receiver.stats()})")
                    plan = verifier.before(update)
                    engine.apply_weights(update)
                    result = verifier.after(engine, update, plan)
                    receiver.commit(update.version)
                    reply = {"version": update.version, "mode": update.mode, "tensors": len(update.tensors),
                             "mismatched": result.mismatched if result else [],
                             "unverifiable": result.unverifiable if result else []}
                elif op == "checksums":
                    held = engine.weight_checksums(msg["mode"], list(msg["names"]))  # vLLM LoRA: its adapter slot
                    reply = {"checksums": {n: None if v is None else [v[0], int(v[1])] for n, v in held.items()}}
                elif op == "generate":
                    reply = {"groups": _groups(engine, msg["prompts"], msg["n"])}
                elif op == "topk":
                    calls += 1
                    topk = _topk_vllm if hasattr(engine, "llm") else _topk_hf
                    reply = {"rows": topk(engine, msg["prompts"], msg["n"], msg["k"], config["seed"] * 1000 + calls)}
                elif op == "specs":
                    reply = _specs(engine)
                else:
                    raise ValueError(f"unknown request {op!r}")
            except Exception as e:  # noqa: BLE001 - process boundary: the check process reports it as the stage's failure
                import traceback

                reply = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"}
            sock.send_multipart(encode(_KIND, reply), copy=False)
    finally:
        receiver.close()
        engine.close()
        sock.close(linger=0)
        ctx.term()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.check._engine")
    p.add_argument("--control", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--config-json", required=True)
    p.add_argument("--engine-class")
    p.add_argument("--weights", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--import", dest="imports", action="append", default=[])
    args = p.parse_args(argv)
    import importlib

    for module in args.imports:  # CheckContext.imports: a custom architecture's registration, a test's fault
        importlib.import_module(module)
    from asyncrl.lifeline import die_with_parent

    die_with_parent(args.parent_pid, what="asyncrl check engine")
    _serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
