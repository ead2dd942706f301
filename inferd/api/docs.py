"""OpenAPI descriptions of the data-plane bodies.

The hot routes parse bodies with orjson against the model signature instead of a
pydantic model (a signature is only known at run time, and per-request model
validation would cost more than the inference it wraps), so their request bodies are
documented here for ``/docs``.
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
