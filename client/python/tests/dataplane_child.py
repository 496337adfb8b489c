"""A client process for test_dataplane's killed-client case: registers its own shared-memory
region, begins a planned decode over the given slots, rings layer 0, waits for its output,
prints "rung" and then waits to be killed.

    dataplane_child.py ADDRESS REGION_NAME SHM_KEY SLOT...
"""

import sys
import time
from multiprocessing import resource_tracker

import numpy as np

import replayssm
from replayssm import plan, regions
from support import activations


def main(address, name, key, *slots):
    with replayssm.Client(address, timeout=30) as client:
        model = client.model
        region = regions.SharedMemoryRegion(name, plan.ForwardPlan.nbytes(model, len(slots)),
                                            key=key)
        # The test removes the object: Python's tracker would too, and warn, once we are killed.
        resource_tracker.unregister(region._shm._name, "shared_memory")
        forward = plan.ForwardPlan.layout(region, model, len(slots))
        client.register_region(region)
        stream = client.open_stream()
        stream.begin([(int(s), 9) for s in slots], plan=forward)
        layer0 = activations(model, len(slots), np.random.default_rng(0))[0]
        for tensor, x in zip(forward.layers[0].head(len(slots)), layer0):
            tensor.write(x)
        forward.ring(0)
        forward.wait_done(0, timeout=20)
        print("rung", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:])
