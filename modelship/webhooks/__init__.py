"""The registry trigger: MLflow webhooks (HMAC-signed) that start the ``promote`` deployment.

``verify`` holds the pure checks (signature, timestamp window, replay log, what a payload
asks for); ``server`` is the HTTP receiver the embedded stack runs.
"""
