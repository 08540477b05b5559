"""Running the GPU path without a GPU: code executed on fake CUDA tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``), with what it asks of the device recorded.
``host_syncs``: every place that moves data between the host and the device or waits for a
device value."""
