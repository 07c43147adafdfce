import os

from celery import Celery

app = Celery("celery_tasks", broker=os.environ["BROKER"])
app.conf.broker_connection_retry_on_startup = True


@app.task
def add(x, y, path):
    with open(path, "a") as f:
        f.write(f"{x + y}\n")
    return x + y
