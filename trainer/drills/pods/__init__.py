"""The shipped Kubernetes manifests run as local pods, for the overlay drills
(``trainer.drills.overlay_drills``): see ``local_cluster`` for how, ``manifest`` for the sources each
controller's part follows, ``cpu_substitutions`` for everything the harness changes."""
