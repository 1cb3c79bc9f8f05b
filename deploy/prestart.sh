#!/bin/sh
# Runs database migrations before a gateway replica starts (idempotent).
set -e
tiergate db upgrade
