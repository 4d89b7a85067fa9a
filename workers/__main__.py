"""``python -m workers``: run one rollout worker (the local launcher's entry point)."""

from asyncrl.cli import main

if __name__ == "__main__":
    main(["worker", *__import__("sys").argv[1:]])
