"""The cluster layer: membership, leases, the controller and the placement table, in etcd.

Between service/ (which asks it where a stream lives) and storage/. It never imports
service/. Import its modules directly (`from cluster.coordinator import Coordinator`):
this package file stays empty so that service/config.py can use `cluster.addresses`
to check the cluster settings without loading the etcd client in embedded mode.
"""
