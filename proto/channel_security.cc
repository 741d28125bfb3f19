#include "proto/channel_security.h"

#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/client_interceptor.h"

namespace shard {
namespace {

constexpr size_t kMaxTokenBytes = 4096;
constexpr size_t kMaxPemBytes = 1 << 20;

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view what) {
  absl::StatusOr<std::string> pem = ReadFile(path);
  if (!pem.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": ", pem.status().message()));
  }
  if (pem->size() > kMaxPemBytes || pem->find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " is not a PEM file (no '-----BEGIN' line)"));
  }
  return pem;
}

// Adds the bearer token to every call of the channel.
class TokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kAuthorizationHeader, *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* header_;
};

class TokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(const std::string& token) : header_("Bearer " + token) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new TokenInterceptor(&header_);
  }

 private:
  const std::string header_;
};

}  // namespace

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, ": ", text.status().message()));
  }
  const std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty() || token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token file ", path, " must hold one token of 1 to ", kMaxTokenBytes, " bytes"));
  }
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token file ", path, " must hold one line of printable ASCII without spaces "
          "(e.g. from 'openssl rand -hex 32')"));
    }
  }
  return token;
}

bool TokensEqual(absl::string_view presented, absl::string_view expected) {
  if (expected.empty()) return false;
  unsigned char differ = presented.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < presented.size(); ++i) {
    differ |= static_cast<unsigned char>(presented[i] ^ expected[i % expected.size()]);
  }
  return differ == 0;
}

absl::StatusOr<ClientSecurity> LoadClientSecurity(const ClientSecurityFiles& files) {
  ClientSecurity security;
  if (files.ca.empty() && (!files.cert.empty() || !files.key.empty() ||
                           !files.server_name.empty())) {
    return absl::InvalidArgumentError(
        "--tls-cert, --tls-key and --tls-server-name need --tls-ca (the CA that signed the "
        "coordinator's certificate)");
  }
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!files.ca.empty()) {
    SHARD_ASSIGN_OR_RETURN(std::string ca, ReadPem(files.ca, "--tls-ca"));
    security.root_ca_pem = std::move(ca);
  }
  if (!files.cert.empty()) {
    SHARD_ASSIGN_OR_RETURN(std::string cert, ReadPem(files.cert, "--tls-cert"));
    SHARD_ASSIGN_OR_RETURN(std::string key, ReadPem(files.key, "--tls-key"));
    security.cert_pem = std::move(cert);
    security.key_pem = std::move(key);
  }
  security.server_name = files.server_name;
  if (!files.token.empty()) {
    SHARD_ASSIGN_OR_RETURN(std::string token, ReadTokenFile(files.token));
    security.token = std::move(token);
  }
  return security;
}

std::shared_ptr<grpc::Channel> CreateSecureChannel(const std::string& address,
                                                   const ClientSecurity& security,
                                                   grpc::ChannelArguments args) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!security.root_ca_pem.empty()) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = security.root_ca_pem;
    options.pem_cert_chain = security.cert_pem;
    options.pem_private_key = security.key_pem;
    credentials = grpc::SslCredentials(options);
    if (!security.server_name.empty()) {
      args.SetSslTargetNameOverride(security.server_name);
    }
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!security.token.empty()) {
    interceptors.push_back(std::make_unique<TokenInterceptorFactory>(security.token));
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                 std::move(interceptors));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> LoadServerCredentials(
    const ServerSecurityFiles& files) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (files.cert.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key for the coordinator");
    }
    return grpc::InsecureServerCredentials();
  }
  SHARD_ASSIGN_OR_RETURN(std::string cert, ReadPem(files.cert, "--tls-cert"));
  SHARD_ASSIGN_OR_RETURN(std::string key, ReadPem(files.key, "--tls-key"));
  grpc::SslServerCredentialsOptions options(
      files.client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_key_cert_pairs.push_back({key, cert});
  if (!files.client_ca.empty()) {
    SHARD_ASSIGN_OR_RETURN(std::string ca, ReadPem(files.client_ca, "--tls-client-ca"));
    options.pem_root_certs = ca;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace shard
