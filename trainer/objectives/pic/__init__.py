"""PIC: a sliding window of classes, recent-negative sampling, and the rows that live off the
device with their exact lazy SGD catch-up."""
