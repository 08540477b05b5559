"""The data sets' sizes the benchmarks and docs use, each with its source, so that one figure is used
everywhere (the configs' ``num_classes`` comments and k8s/README.md give the same)."""

# ILSVRC-2012 (ImageNet-1K) training images: the 1,281,167 of the challenge's train split.
IMAGENET_1K = 1_281_167
# ImageNet-21K, fall 2011 release: 14,197,122 images in 21,841 synsets (image-net.org's summary of
# the full ImageNet; the figure the configs and `instcls plan` examples use).
IMAGENET_21K = 14_197_122
