"""``python -m workers``: run one rollout worker (the local launcher's entry point).

The parent's lifeline is armed before anything else is imported: a worker whose launcher dies while it
is still importing torch or loading its engine exits within a fraction of a second (asyncrl.lifeline).
"""

import sys

if __name__ == "__main__":
    if "--parent-pid" in sys.argv[:-1]:
        from asyncrl.lifeline import die_with_parent

        die_with_parent(int(sys.argv[sys.argv.index("--parent-pid") + 1]), what="rollout worker")

    from asyncrl.cli import main

    main(["worker", *sys.argv[1:]])
