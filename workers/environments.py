"""Multi-turn environments: the worker alternates generation and ``env.step`` until done.

An episode's rollout keeps every token in order — generated tokens (``loss_mask`` True, with
their rollout logprobs and policy versions) and environment tokens (``loss_mask`` False, logprob
0) — so the trainer's loss covers exactly what the policy produced. One environment instance per
sample; the samples of all leases in a batch advance turn by turn in one engine call per turn.
The rollout's reward is the sum of the step rewards (:func:`env_reward`, the worker's only reward function
when it runs an environment), with the last step's ``info`` as its components. Configs name an environment class as
``"module:Class"``; it is constructed with no arguments.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.rollout import spans_of
from workers.engines.base import Completion, Engine, GenerationRequest

__all__ = ["ArithmeticRetryEnv", "EnvStep", "Environment", "env_reward", "load_environment", "run_episodes"]


@dataclass(kw_only=True, slots=True)
class EnvStep:
    observation: str = ""
    """Text appended after the policy's turn (ignored when ``done``)."""
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


class Environment(abc.ABC):
    max_turns: int = 4
    """The episode ends after this many policy turns even if the environment is not done."""

    @abc.abstractmethod
    def reset(self, prompt: Any) -> None:
        """Starts an episode for a prompt item."""

    @abc.abstractmethod
    def step(self, response_text: str) -> EnvStep:
        """Reacts to one policy turn."""


class ArithmeticRetryEnv(Environment):
    """The embedded task with feedback: a wrong answer gets ``" no, again:"`` and another try.

    Reward 1 for a correct answer on the first turn, 0.5 on a later one, 0 if never.
    """

    max_turns = 2

    def reset(self, prompt: Any) -> None:
        self.answer = str(prompt["answer"])
        self.turn = 0

    def step(self, response_text: str) -> EnvStep:
        self.turn += 1
        if response_text.strip() == self.answer:
            return EnvStep(reward=1.0 if self.turn == 1 else 0.5, done=True, info={"turns": self.turn})
        return EnvStep(observation=" no, again:", done=self.turn >= self.max_turns, info={"turns": self.turn})


def env_reward(prompts: list[Any], completions: list[Completion]) -> list[dict[str, float]]:
    """An episode's reward: the sum of its step rewards, with the last step's ``info`` as components."""
    return [{"reward": float(c.env_reward or 0.0), **c.env_info} for c in completions]


def load_environment(spec: str) -> type[Environment]:
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"environment {spec!r} must be 'module:Class'")
    return getattr(importlib.import_module(module), name)


@dataclass(slots=True)
class _Episode:
    env: Environment
    prompt_ids: torch.Tensor
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "env"
    done: bool = False
    texts: list[str] = field(default_factory=list)


def run_episodes(engine: Engine, env_cls: type[Environment], requests: list[GenerationRequest]) -> list[list[Completion]]:
    """Runs ``request.n`` episodes per request; returns completions with loss masks and version spans."""
    episodes: list[list[_Episode]] = []
    for req in requests:
        group = []
        for _ in range(req.n):
            env = env_cls()
            env.reset(req.prompt)
            group.append(_Episode(env, torch.empty(0, dtype=torch.int32)))
        episodes.append(group)
    for turn in range(env_cls.max_turns):
        active = [(ri, ep) for ri, group in enumerate(episodes) for ep in group if not ep.done]
        if not active:
            break
        turn_requests = [
            GenerationRequest(
                epoch=requests[ri].epoch,
                prompt_index=requests[ri].prompt_index,
                prompt=requests[ri].prompt if turn == 0 else {"prompt_ids": [*ep.prompt_ids.tolist(), *ep.ids]},
                n=1,
            )
            for ri, ep in active
        ]
        for (ri, ep), (c,) in zip(active, engine.generate(turn_requests)):
            if turn == 0:
                ep.prompt_ids = c.prompt_ids
            _append(ep, c)
            step = ep.env.step(c.text if c.text is not None else engine.decode(c.response_ids))
            ep.reward += step.reward
            ep.info = {k: float(v) for k, v in step.info.items()}
            if step.done or turn == env_cls.max_turns - 1:
                ep.done, ep.finish_reason = True, "env" if step.done else c.finish_reason
            else:
                obs = engine.encode(step.observation)
                ep.ids += obs
                ep.logprobs += [0.0] * len(obs)
                ep.mask += [False] * len(obs)
                ep.versions += [ep.versions[-1] if ep.versions else c.policy_version] * len(obs)
    return [[_completion(ep) for ep in group] for group in episodes]


def _append(ep: _Episode, c: Completion) -> None:
    n = int(c.response_ids.numel())
    ep.ids += c.response_ids.tolist()
    ep.logprobs += c.logprobs.tolist()
    ep.mask += [True] * n
    spans = c.version_spans or [(c.policy_version, 0, n)]
    for version, start, end in spans:
        ep.versions += [version] * (end - start)
    ep.texts.append(c.text or "")


def _completion(ep: _Episode) -> Completion:
    spans = spans_of(ep.versions)
    c = Completion(
        prompt_ids=ep.prompt_ids,
        response_ids=torch.tensor(ep.ids, dtype=torch.int32),
        logprobs=torch.tensor(ep.logprobs, dtype=torch.float32),
        finish_reason=ep.finish_reason,
        policy_version=min(ep.versions) if ep.versions else 0,
        version_spans=spans if len(spans) > 1 else [],
        loss_mask=torch.tensor(ep.mask, dtype=torch.bool),
        text="".join(ep.texts),
        env_reward=ep.reward,
        env_info=ep.info,
    )
    return c
