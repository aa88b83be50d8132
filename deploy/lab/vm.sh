#!/usr/bin/env bash
# Shared by deploy/lab/run.sh and bench/boot.sh (source it): the QEMU command line of a
# lab machine that network-boots over tap0 (TCG, 512 MiB or $VM_MEMORY_MB, serial console to a file,
# virtio-net; UEFI with a fresh copy of OVMF's variables).
#
# vm_command FIRMWARE SERIAL_LOG VARS_DIR MAC: sets the array VM_COMMAND.
vm_command() {
  local firmware=$1 log=$2 vars=$3/vars.fd mac=$4
  VM_COMMAND=(qemu-system-x86_64 -machine q35,accel=tcg -m "${VM_MEMORY_MB:-512}" -nographic -monitor none -no-reboot
    -serial "file:$log" -netdev tap,id=n0,ifname=tap0,script=no,downscript=no -boot n)
  if [ "$firmware" = uefi ]; then
    cp /usr/share/OVMF/OVMF_VARS_4M.fd "$vars"
    VM_COMMAND+=(-drive if=pflash,format=raw,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd
      -drive "if=pflash,format=raw,file=$vars" -device "virtio-net-pci,netdev=n0,mac=$mac,romfile=")
  else
    VM_COMMAND+=(-device "virtio-net-pci,netdev=n0,mac=$mac")
  fi
}
