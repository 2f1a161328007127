"""A post-training pipeline around reshard: the checkpoint a training job just saved is converted
to Hugging Face by reshard's own flow, run as a subflow (per-shard tasks, retries, caching,
resume), and the export is evaluated by a task of yours.

Run it once by hand::

    python docs/examples/post_training.py /ckpt/run7/iter_0001000 /exports/run7-1000

against your Prefect server when ``PREFECT_API_URL`` names one; without it, on the server
reshard's CLI uses (``prefect_session``: reshard's own database beside its cache, no telemetry,
stopped at the end) rather than Prefect's temporary one on ``~/.prefect``.

or deploy ``post_training`` with a trigger on the event a training job emits when it finishes
(``reshard emit-training-completed URL --tp 8 --step 1000``; docs/deployments.md)::

    triggers:
      - type: event
        expect: [reshard.training.completed]
        match: {reshard.tp: "8"}
        parameters:
          checkpoint: "{{ event.resource['reshard.url'] }}"
          output: "{{ event.resource['reshard.url'] }}-hf"
"""

from __future__ import annotations

import json
import sys

from prefect import flow, task

from reshard.flows.params import ReshardParams
from reshard.flows.reshard_flow import reshard_flow
from reshard.flows.session import prefect_session
from reshard.result import ConversionResult


@task
def evaluate(export: ConversionResult) -> float:
    """Your evaluation: here, the loss of the exported model on a few tokens, in transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export.destination)
    tokens = torch.arange(16).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad():
        return float(model(tokens, labels=tokens).loss)


@flow(name="post-training")
def post_training(checkpoint: str, output: str) -> dict[str, object]:
    export = reshard_flow(ReshardParams(source=checkpoint, destination=output, to="hf"))  # a subflow run
    loss = evaluate(export)
    return {"export": export.destination, "files": [f.path for f in export.files], "loss": loss,
            "conversion_flow_run": export.flow_run_id}


if __name__ == "__main__":
    with prefect_session():  # your server if PREFECT_API_URL is set, else reshard's embedded one
        result = post_training(sys.argv[1], sys.argv[2])
    print(json.dumps(result))
