"""Prefill/decode disaggregation's KV transfer: how a decode instance gets a prompt's KV-cache
blocks from the prefill instance that computed them.

- `connector.py`: `KVConnectorGroup`, the engine's one view of an instance's KV connectors (it
  forwards each call to every rank through the executor and joins their answers);
- `handler.py`: `KVTransferHandler`, a rank's side, called by its worker with its model runner;
- `transport.py`: `KVConnector`, one rank's ZMQ server (leases, answering pulls) and client (pulls
  into allocated blocks);
- `frames.py`: the wire format of a pull's blocks (header, CRC-32, gather/scatter of cache rows);
- `stats.py`: a pull's result and the counters the instance reports.

Deployment (rank tables, launching instances, router policies) is in splitserve/disagg/.
"""
