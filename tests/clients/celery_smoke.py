"""A stock Celery worker and client (kombu over py-amqp) against mirrorq:
the worker declares its exchanges and queues, consumes, and runs the tasks
the client sends. Exits non-zero if any task does not run."""
import os
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(tempfile.mkdtemp(), "out.txt")
env = dict(os.environ, C_FORCE_ROOT="1")
worker = subprocess.Popen(
    [sys.executable, "-m", "celery", "-A", "celery_tasks", "worker", "--pool=solo", "-l", "info"],
    cwd=here, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
)
try:
    sys.path.insert(0, here)
    import celery_tasks

    for i in range(5):
        celery_tasks.add.delay(i, 100, out)
    deadline = time.time() + 60
    lines = []
    while time.time() < deadline:
        if os.path.exists(out):
            lines = sorted(open(out).read().split())
            if len(lines) == 5:
                break
        time.sleep(0.2)
    assert lines == ["100", "101", "102", "103", "104"], lines
    print("celery ok")
finally:
    worker.terminate()
    try:
        log, _ = worker.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        worker.kill()
        log, _ = worker.communicate()
    # Shown by the Rust test only when it fails.
    print(log, file=sys.stderr)
