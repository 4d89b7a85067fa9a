"""``python -m workers``: run one rollout worker (the local launcher's entry point).

The parent's lifeline is armed before anything else is imported: a worker whose launcher dies while it
is still importing torch or loading its engine exits within a fraction of a second (asyncrl.lifeline).
With ``--await-argv`` the process was prestarted (workers.prestart): it imports first and reads its command line
from stdin. The cyclic garbage collector is off during the imports and the heap they built is then frozen
(:mod:`asyncrl._gc`).
"""

import gc
import sys

if __name__ == "__main__":
    gc.disable()  # until the imports are done (asyncrl._gc)
    if "--parent-pid" in sys.argv[:-1]:
        from asyncrl.lifeline import die_with_parent

        die_with_parent(int(sys.argv[sys.argv.index("--parent-pid") + 1]), what="rollout worker")

    argv = sys.argv[1:]
    if "--await-argv" in argv:  # prestarted (workers.prestart): imports now, the command line once the pools exist
        from workers.prestart import await_argv

        argv = await_argv(argv, exit_on_early_eof=True)
        if argv is None:  # never used: the trainer closed our stdin or exited
            sys.exit(0)
    else:  # a cold start (a restart, or a launcher without prestart) imports the same modules first
        from workers.prestart import preload

        preload(argv)
    from asyncrl._gc import freeze_import_heap
    from asyncrl.cli import main

    freeze_import_heap()
    main(["worker", *argv])
