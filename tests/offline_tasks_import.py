"""`python -m tests.offline_tasks_import` (tests/test_tasks_tfds.py): imports the tasks with
the network and TFDS's dataset builders refused, then prints the TFDS tasks it registered."""

import socket


def refuse(*args, **kwargs):
    raise RuntimeError("network used at import")


socket.socket.connect = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse

import tensorflow_datasets as tfds  # noqa: E402  (TFDS reaches GCS from C++, past `socket`)

tfds.builder = tfds.load = tfds.core.DatasetBuilder.__init__ = refuse

import seqio  # noqa: E402

import tasks  # noqa: E402, F401

print(sorted(set(seqio.TaskRegistry.names()) & {"c4_en", "lm1b", "wiki40b_en"}))
