"""OpenAPI descriptions of the bodies that routes parse themselves.

The hot routes parse bodies with orjson against the model signature instead of a
pydantic model (a signature is only known at run time, and per-request model
validation would cost more than the inference it wraps), so their request bodies are
documented here for ``/docs``. The deployment routes do the same: the registry checks
the values, the route only the JSON shape, so there is no model to derive a schema from.
"""

PREDICT = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "inputs": {
                            "type": "array",
                            "description": "Rows; each an object with the model's input fields "
                            "(see GET /api/v1/models/{model}), or a bare value for "
                            "single-input models.",
                            "items": {},
                        },
                        "params": {
                            "type": "object",
                            "properties": {
                                "version": {"type": "string"},
                                "timeout_ms": {"type": "number"},
                            },
                        },
                    },
                },
                "example": {"inputs": [{"features": [0.5, 1.2, 3.4]}], "params": {"version": "v3"}},
            }
        },
    }
}

PREDICT_ONE = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["model", "input"],
                    "properties": {
                        "model": {"type": "string"},
                        "input": {"type": "object"},
                        "params": {"type": "object"},
                    },
                },
                "example": {"model": "sentiment", "input": {"text": "This product is amazing!"}},
            }
        },
    }
}

EMBED = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["model", "inputs"],
                    "properties": {
                        "model": {"type": "string"},
                        "inputs": {"type": "array", "items": {"type": "string"}},
                        "params": {"type": "object"},
                    },
                },
                "example": {"model": "all-minilm-l6-v2", "inputs": ["Hello world", "How are you"]},
            }
        },
    }
}

DEPLOY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["model_name", "version"],
                    "properties": {
                        "model_name": {"type": "string"},
                        "version": {"type": "string", "description": "A registered version."},
                        "traffic_percent": {
                            "type": "integer",
                            "minimum": 0,
                            "maximum": 100,
                            "default": 100,
                            "description": "Its share; the other deployed versions share "
                            "the rest in proportion. canary: its first step (default 1); "
                            "shadow: the percent of requests mirrored to it.",
                        },
                        "resources": {
                            "type": "object",
                            "properties": {
                                "replicas": {
                                    "type": ["integer", "null"],
                                    "minimum": 1,
                                    "description": "null: the server's default.",
                                },
                                "gpu": {"type": ["string", "null"]},
                            },
                        },
                        "strategy": {
                            "type": "string",
                            "enum": ["rolling", "blue-green", "canary", "shadow"],
                            "default": "rolling",
                        },
                        "batching": {
                            "type": ["object", "null"],
                            "description": "max_batch_size, max_wait_ms, ... for this version.",
                        },
                        "fallback": {
                            "type": "boolean",
                            "default": True,
                            "description": "Retry requests this version fails on the serving "
                            "version.",
                        },
                        "rollout": {
                            "type": ["object", "null"],
                            "description": "The strategy's settings. blue-green: keep_old_s. "
                            "canary: steps, step_s, min_requests, max_error_rate_increase, "
                            "max_latency_increase, min_latency_increase_ms, latency "
                            "(compute|total), quantile, max_p99_ms, webhook, auto_rollback, "
                            "keep_old_s. shadow: "
                            "tolerance.",
                        },
                    },
                },
                "example": {
                    "model_name": "fraud_detector",
                    "version": "v3.1",
                    "traffic_percent": 10,
                    "resources": {"replicas": 2, "gpu": None},
                    "strategy": "canary",
                    "rollout": {"steps": [10, 50, 100], "step_s": 300},
                },
            }
        },
    }
}

TRAFFIC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": "Deployed version -> percent; the percents sum to 100 and "
                    "versions left out get 0.",
                    "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "example": {"v3.0": 50, "v3.1": 50},
            }
        },
    }
}


EXPLAIN = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": PREDICT["requestBody"]["content"]["application/json"]["schema"],  # type: ignore[index]
                "example": {"inputs": [{"features": [5.1, 3.5, 1.4, 0.2]}]},
            }
        },
    }
}

EXPLAIN_V1 = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["instances"],
                    "properties": {"instances": {"type": "array", "items": {}}},
                },
                "example": {"instances": [{"features": [5.1, 3.5, 1.4, 0.2]}]},
            }
        },
    }
}
