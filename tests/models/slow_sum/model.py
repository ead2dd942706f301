"""Test model: sums 4 features; sleeps per batch so concurrent requests batch up."""

import time

import numpy as np


class SlowSum:
    signature = {
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        features = batch["features"]
        if (features == 666).any():
            raise ValueError("the model refuses 666")
        time.sleep(0.02)
        return {"prediction": features.sum(axis=1).astype(np.float32)}
