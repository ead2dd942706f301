"""Test model whose load takes a minute: longer than a short load timeout."""

import time


class SlowLoad:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
    }

    def load(self, artifact_dir):
        time.sleep(60)

    def predict(self, batch):
        return {"prediction": batch["x"]}
