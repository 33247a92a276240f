"""The machinery behind train.py and the other commands: config rules (plan), errors, layers."""
