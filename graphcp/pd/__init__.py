"""PD disaggregation, prefill side: the KV of a prefilled request goes to a decode worker over Mooncake.

``KVReceiver`` stands in for the decode worker's receiving end (its own process and Mooncake engine);
``sender.KVSender`` is one rank's half: it writes its share of a request's cache straight from the KV pool.
"""
from graphcp.pd.receiver import KVReceiver

__all__ = ["KVReceiver"]
