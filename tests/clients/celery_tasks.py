import os

from celery import Celery

app = Celery("celery_tasks", broker=os.environ["BROKER"])
app.conf.broker_connection_retry_on_startup = True
if os.environ.get("BROKER_CA"):
    # amqps: the broker's certificate checked against the test's CA.
    import ssl

    app.conf.broker_use_ssl = {"ca_certs": os.environ["BROKER_CA"], "cert_reqs": ssl.CERT_REQUIRED}


@app.task
def add(x, y, path):
    with open(path, "a") as f:
        f.write(f"{x + y}\n")
    return x + y
